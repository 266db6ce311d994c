"""What a step computes where: index plans built from the block tables and
sequence lengths (`step_plan`: any step on the host; `decode_plan`: a uniform
decode batch on the device), and the unit writes of dynamic boundaries.
Plans import no kernel; kernels read plans.
"""
