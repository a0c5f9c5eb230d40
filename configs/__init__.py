"""Shipped run configs (YAML), usable by short name: `pretrain train baseline/tiny`."""
