"""Calibration: data sets (data.py) and the layer-by-layer walk that feeds them through a model (sequential.py)."""
