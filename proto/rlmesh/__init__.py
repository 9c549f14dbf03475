"""rlmesh wire contracts (package rlmesh.v1)."""
