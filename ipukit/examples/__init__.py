"""Runnable examples: the MNIST pipelining tutorial's model and script."""
