"""The node image: one file that runs a node on a machine with only ``python3``.

``python -m metropolis.image build --out DIR [--etcd PATH]`` packs the node
program (`metropolis`, `common`), the distributions it imports and an
etcd binary into ``DIR/<sha256>.pyz``, a zipapp built by shiv: its name is
its SHA-256, so a downloader verifies what it got against the name it
asked for. ``python3 IMAGE node register ...`` then runs exactly what
``python -m metropolis node register ...`` runs, with the bundled etcd.

Modules: :mod:`.contents` (what goes in), :mod:`.build` (the builder, and
why shiv), :mod:`.bundle` (the bundled etcd and its manifest, found and
checked at run time), :mod:`.entry` (the image's entry point),
:mod:`.errors` (`ImageError`).
"""
