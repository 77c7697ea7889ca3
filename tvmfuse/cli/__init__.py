"""The command line: parses arguments, calls the library, prints a table or one JSON object."""
