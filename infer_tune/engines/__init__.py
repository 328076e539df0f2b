"""Serving engines other than infer-tune's own, built or found on the host: llama.cpp (`llamacpp.py`)."""
