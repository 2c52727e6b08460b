"""Making sparse models: activation profiling (`profile`) and predictor training (`train-predictor`)."""

from powerinfer.profile.activation import (
    ActivationProfile,
    ProfileOptions,
    plot_curves,
    profile_engine,
    run_profile,
    write_activation_folder,
)
from powerinfer.profile.collect import FiringRecorder, make_windows, read_corpus, recording, tokenize_corpus
from powerinfer.profile.predictor import (
    LayerMetrics,
    PredictorOptions,
    PredictorReport,
    PredictorSet,
    evaluate_on_text,
    load_predictor_folder,
    train_predictors,
    write_predictor_folder,
)

__all__ = [
    "ActivationProfile",
    "FiringRecorder",
    "LayerMetrics",
    "PredictorOptions",
    "PredictorReport",
    "PredictorSet",
    "ProfileOptions",
    "evaluate_on_text",
    "load_predictor_folder",
    "make_windows",
    "plot_curves",
    "profile_engine",
    "read_corpus",
    "recording",
    "run_profile",
    "tokenize_corpus",
    "train_predictors",
    "write_activation_folder",
    "write_predictor_folder",
]
