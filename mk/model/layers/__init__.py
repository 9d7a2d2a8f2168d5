"""The K3 sublayers as pure functions of arrays, one file each (spec 1.4).

They are shared by the pure-JAX reference (`mk.model.reference`) and, for the elementwise math, by the
megakernel body (`mk.kernel`), so both apply the same rounding points in the same order.
"""
