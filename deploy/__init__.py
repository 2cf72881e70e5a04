"""Deployment tooling: the Helm chart's renderer (chart.py), its pod specs as docker run
arguments (pods.py) and `make deploy-check` (check.py)."""
