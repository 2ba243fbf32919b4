"""The device side: everything that owns or builds device state. The runner owns the
params, the paged cache and the carry; the step is one jitted, donated function over
the batch pytree."""
