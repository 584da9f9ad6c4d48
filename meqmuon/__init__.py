"""meqmuon: MeqMuon (Matrix-Equilibrating Muon) and faithful Muon-family baselines for LLM pretraining."""

__version__ = "0.1.0"
