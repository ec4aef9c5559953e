"""Tools: the planner (tools/plan.py, torch-free, over plan_ring.py: bytes, steps, work and memory of a CP
configuration, and plan_exchanges.py: the K/V exchanges compared), the
``cp-dtensor`` command line (tools/cli.py) and ``CommBytes`` (tools/debug.py: bytes per collective, by group).
"""
