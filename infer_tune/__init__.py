"""infer-tune: apply real LLM-inference optimizations and measure what each buys and costs."""

__version__ = "0.1.0"
