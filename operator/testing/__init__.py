"""Test kit for the operator: an emulated API server (kmock + admission) and CRD checks.

Used by ``tests/operator`` and ``bench/operator_*.py``; needs the ``dev`` extras
(kmock, cel-python, jsonschema), never imported by the operator itself.
"""
