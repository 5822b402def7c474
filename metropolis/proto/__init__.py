"""Protobuf messages of the node (sources: ``*.proto`` here; classes: ``gen/``).

Regenerate with ``nox -s proto`` after editing a ``.proto`` file.
"""
