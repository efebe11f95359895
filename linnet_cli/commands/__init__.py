"""One module per command; each parses options, calls one core function, renders the result."""
