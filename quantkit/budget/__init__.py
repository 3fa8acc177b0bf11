"""Quantizing to an accuracy budget: per-unit sensitivity, the cheapest mix that meets the budget, and its proof."""
