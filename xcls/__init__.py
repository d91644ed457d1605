"""xcls command line and configuration (thin: library code lives in ams/, workers/, bridge/)."""
