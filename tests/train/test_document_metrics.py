"""Document-aware evaluation (train/document_metrics.py) against values counted by hand."""

import math

import numpy as np
import torch

from relpos_ablate.train.document_metrics import document_metrics, places

S = 0  # the separator


def test_places_count_from_each_documents_separator():
    inputs = torch.tensor([[4, 4, S, 5, 6, S, 7], [S, 8, 8, 8, S, 9, 9]])
    document, place = places(inputs, S)
    # stream 0 starts inside a document begun elsewhere: no place there
    assert document.tolist() == [[-1, -1, 0, 0, 0, 1, 1], [2, 2, 2, 2, 3, 3, 3]]
    assert place.tolist() == [[-1, -1, 0, 1, 2, 0, 1], [0, 1, 2, 3, 0, 1, 2]]


def test_metrics_weigh_each_document_once_and_bin_by_place():
    inputs = torch.tensor([[S, 1, 1, 1, 1, S, 2]])
    losses = np.array([[1.0, 2.0, 3.0, 4.0, np.nan, 10.0, 20.0]])
    record = document_metrics(*places(inputs, S), losses, train_length=3)
    # document 0: places 0-3 (place 4 not scored), losses 1, 2, 3, 4; document 1: 10, 20
    assert record["documents"] == 2 and record["tokens"] == 6
    assert math.isclose(record["loss"], (2.5 + 15.0) / 2)
    assert math.isclose(record["token_loss"], 40.0 / 6)
    position = record["position_loss"]
    assert position["edges"] == [0, 1, 2, 4]  # places 0 .. 3
    assert position["tokens"] == [2, 2, 2]
    assert np.allclose(position["loss"], [(1 + 10) / 2, (2 + 20) / 2, (3 + 4) / 2])
    assert record["beyond_train_length"] == {"from": 3, "loss": 4.0, "tokens": 1}


def test_targets_before_a_streams_first_separator_are_counted_apart():
    inputs = torch.tensor([[7, 7, S, 1]])
    losses = np.array([[5.0, 5.0, 1.0, 1.0]])
    record = document_metrics(*places(inputs, S), losses, train_length=8)
    assert record["tokens_without_start"] == 2 and record["tokens"] == 2
    assert record["beyond_train_length"]["loss"] is None
