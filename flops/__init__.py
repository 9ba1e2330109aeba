"""Analytic FLOPs, KV entries and parameters (MoSA App. C), the IsoFLOP solver, and IsoFLOP sweeps.

formulas.py: one cost function per head type; model.py: model totals, training FLOPs, MFU;
presets.py: Table 4 sizes (+ micro); isoflop.py: solver + CLI; sweep.py / run_sweep.py / aggregate.py:
FLOP-matched configs, their training, and the results table and curve; cli.py: the parser and argparse
types the scripts of flops/ and bench/ share.
"""
