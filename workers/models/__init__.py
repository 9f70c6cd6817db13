"""Models that ship with the project (`demo`) and the code that trains them (`training/`)."""
