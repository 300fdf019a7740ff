"""Adapters between odc_runtime and training frameworks.

Each submodule is imported on its own (``import odc_runtime.integrations.verl``) and never by ``import
odc_runtime``; none of them needs its framework installed to be imported, only to be attached to it.
"""
