"""Linear attention under CP: state passing for delta-rule layers (``linear_attention``) and the causal conv's halo
(``linear_conv``), over their plan (``linear_plan``), runs (``linear_runs``) and single-token steps (``linear_steps``).
Importing this package imports nothing.
"""
