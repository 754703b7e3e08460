"""fly-bench (`cli`) and what the benchmark scripts share: methods, datasets, scoring, reports, confidence."""
