"""Tests of the BMDB against a real PostgreSQL 15."""
