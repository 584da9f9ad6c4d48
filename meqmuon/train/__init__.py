"""Pretraining harness for the MeqMuon experiments: model registry, data pipeline, training loop."""
