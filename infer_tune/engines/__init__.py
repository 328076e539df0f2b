"""What runs a model: the engine registry (`base.py`: `ENGINES`, `Engine`, `register_engine`) and one module per
engine or family of engines that registers itself (docs/architecture.md, "The engine axis"); besides them, the
tools of other engines on this host: llama.cpp's build, GGUFs and llama-bench (`llamacpp.py`), launches of
llama.cpp / vLLM / SGLang servers (`launch.py`), calibration text and imatrix GGUFs (`calibrate.py`)."""
