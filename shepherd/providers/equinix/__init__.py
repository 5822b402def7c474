"""Equinix Metal: the API client (:mod:`.client`), the provider (:mod:`.provider`)
and a local stand-in for the API (:mod:`.localserver`)."""
