"""What the benches share: the Jasper Ridge prologue, the emulated cluster's options, result
records."""
