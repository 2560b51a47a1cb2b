"""Small helpers every layer may use: JSON, files and locks, devices, signals, progress bars, markdown."""
