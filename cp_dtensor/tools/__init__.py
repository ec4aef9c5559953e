"""Tools: the planner (tools/plan.py: bytes, steps, work and memory of a CP configuration, torch-free), the
``cp-dtensor`` command line (tools/cli.py) and ``CommBytes`` (tools/debug.py: bytes per collective, by group).
"""
