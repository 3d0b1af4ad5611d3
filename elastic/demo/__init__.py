"""A self-contained demo of elastic: a byte-level LM on Python's stdlib source, no download.

    elastic demo                      # 3 workers, one killed a quarter in; watch it heal and regrow

`corpus` builds the Parquet corpus, `model` the transformer, `train` the train loop and the
driver side (`run_demo`) that `elastic demo` and examples/train_lm.py call.
"""

from elastic.demo.corpus import prepare_corpus
from elastic.demo.model import ModelConfig, TinyLM
from elastic.demo.train import DemoConfig, default_fault, run_demo, summarize, train_loop

__all__ = ["DemoConfig", "ModelConfig", "TinyLM", "default_fault", "prepare_corpus", "run_demo", "summarize", "train_loop"]
