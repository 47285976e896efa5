#!/bin/sh
# The int4 kernel before 337e141 (the sign trick), built as specdec builds its kernel, into ./old.so.
set -e
src=$(mktemp -d)
for f in int8_linear.c attention.c int4_linear.c; do git show 337e141~1:specdec/backends/kernels/$f > "$src/$f"; done
cc -O3 -std=c11 -fPIC -shared -ffp-contract=off -fno-math-errno -fopenmp "$src"/int8_linear.c "$src"/attention.c "$src"/int4_linear.c -o old.so -lm
