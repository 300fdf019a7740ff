"""odc_runtime: On-Demand Communication."""
