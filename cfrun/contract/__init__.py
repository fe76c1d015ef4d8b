"""The contract between cfrun's processes (torch-free): job-dir layout, settings, messages,
records, errors."""
