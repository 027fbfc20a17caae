"""MkDocs hook: the committed study figures (results/<study>/figures/*.png) join the site under the
same paths, so a page shows one as `results/demo/figures/bias_overview.png` without a copy in
docs/."""

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def on_files(files, config):
    for figure in sorted(ROOT.glob("results/*/figures/*.png")):
        files.append(
            File(
                figure.relative_to(ROOT).as_posix(),
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
