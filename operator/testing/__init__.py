"""The operator's test kit: an emulated API server (kmock + admission), CRD checks, the chart.

Where it sits: beside the operator it drives, as ``kopf.testing`` sits in kopf; used by
``tests/operator``, ``tests/charts`` and ``bench/router/operator_reconcile.py``. It needs the
``dev`` extras (kmock, whose ``_internal`` modules it reads, cel-python, jsonschema, helm) and a
checkout (it reads ``crds/`` and ``charts/``), so ``setup.py`` leaves it out of the wheel.
"""
