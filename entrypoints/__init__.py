"""Composition root: the `rlmesh` command and the local launcher; the only package that imports every tier."""
