"""Measure: what a run reports about itself. `comm` counts every collective and point-to-point
call (`axes` names each call's group by the mesh axis it spans); `traffic` splits bytes into in-node and cross-node; `memory` gives parameter, gradient and
optimizer bytes and the gathered-weight and activation peaks; `timeline` records each rank's
actions for Gantt charts and bubbles; `layout` prints the layout line every run shows at setup.
"""
