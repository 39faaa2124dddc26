"""The compiler: a Keras model -> a program of ops -> the frozen-pattern twin.

`graph` walks the functional model into a `Program` of steps (one per layer
call), each compiled by a rule of `rules` into ops; `interpreter` runs every
pass over it in one walk; `structure` answers who reads a value and where
tangents enter; `bounds` holds the bound passes over the same program (intervals,
the linear relaxation, the backward walk); `layout` names the neuron rows;
`chunking` plans streamed work within a memory budget; `twin` holds `linearize()`
and the `Linearized` facade. docs/design.md, section "Module map".
"""
