"""Timing statistics, quality, memory and roofline metrics."""
