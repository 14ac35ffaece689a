"""Test kit for the operator: an emulated API server (kmock + admission), CRD checks, the chart.

Used by ``tests/operator``, ``tests/charts`` (as ``..operator_kit``) and
``bench/router/operator_reconcile.py`` (with ``tests/`` on its path). It lives under ``tests/``,
not in the package: it needs the ``dev`` extras (kmock, whose ``_internal`` modules it
reads, cel-python, jsonschema, helm) and never ships in the wheel.
"""
