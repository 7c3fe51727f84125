"""WAF planner (paper §5): throughput model, Eq. 2-5, baselines, lookup table. Pure Python + NumPy.

Import the public names from :mod:`plans.api`.
"""
