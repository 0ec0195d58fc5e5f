"""The tokenbus command line and operations tools."""
