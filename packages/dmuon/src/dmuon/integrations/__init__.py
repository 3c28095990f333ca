"""Training frameworks that run dmuon through their public hooks, one module each.

    from dmuon.integrations.hf import DmuonTrainer, DmuonTrainingArguments   # transformers

Each module imports its framework when it is itself imported (``pip install
"./packages/dmuon[hf]"`` from a checkout brings what ``dmuon.integrations.hf`` needs);
``import dmuon`` imports none of them.
"""
