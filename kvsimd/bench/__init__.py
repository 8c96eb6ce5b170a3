"""python -m kvsimd.bench"""
