"""Stages as processes under torchrun: the runtime, the end-of-call exchange, the group,
replicas and the DataLoader's shares. The launcher and popdist's helpers are the front
end in :mod:`ipukit.distributed`.
"""
