"""Consensus: a supervised etcd member, its peer PKI, and a trio-native etcd client."""
