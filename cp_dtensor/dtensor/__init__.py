"""The sequence layouts as DTensor placements (placements.py), the rule that runs
``F.scaled_dot_product_attention`` on sequence-sharded DTensors as the ring (sdpa.py, installed
explicitly), and moving sequence-sharded DTensors between layouts and meshes (sharding.py).
"""
