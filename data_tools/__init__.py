"""Offline data tools: tokenizers, the megatron .bin/.idx format, preprocessing, inspection, merging."""
