"""The chains the console's keys run: stop & bench, grokking runs, data scaling."""
