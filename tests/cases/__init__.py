"""Test bodies run both on the simulated GPU (tests/rig/, tests/serve/) and on the real one (tests/gpu/):
each case takes ``gpu`` ("sim" or "cuda") and what differs between the two, and is called by a
test function on each side.  They live here so that no test module imports another."""
