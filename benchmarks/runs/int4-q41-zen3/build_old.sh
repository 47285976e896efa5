#!/bin/sh
# The int4 kernel before the Q4_1-like format (f335ab6: symmetric, 64 columns per fp32 scale), built as specdec
# builds its kernel, into /tmp/old/old.so (for ab_formats.py).
set -e
mkdir -p /tmp/old
for f in int8_linear.c attention.c int4_linear.c; do git show f335ab6:specdec/backends/kernels/$f > /tmp/old/$f; done
cc -O3 -std=c11 -fPIC -shared -ffp-contract=off -fno-math-errno -fopenmp /tmp/old/int8_linear.c /tmp/old/attention.c \
   /tmp/old/int4_linear.c -o /tmp/old/old.so -lm
