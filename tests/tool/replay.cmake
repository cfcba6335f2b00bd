# .npy replay round trip: gradcheck on the synthetic batch saving its inputs
# (--save-inputs) and outputs (--dump D1), then gradcheck --inputs on the
# saved files dumping D2. Same inputs, same context => bitwise equal outputs.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
set(common gradcheck --config ${CONFIG} --set impl=${IMPL} --set dtype=${DTYPE})
execute_process(COMMAND ${FG} ${common} --save-inputs ${WORK}/inputs --dump ${WORK}/d1
                RESULT_VARIABLE rc1 OUTPUT_VARIABLE o1 ERROR_VARIABLE e1)
message("${o1}${e1}")
if(NOT rc1 EQUAL 0)
  message(FATAL_ERROR "first gradcheck exited with ${rc1}")
endif()
# The replay must not depend on the config's shape keys: give it wrong ones.
execute_process(COMMAND ${FG} ${common} --set batch=7 --set seq_len=3 --set vocab=11
                        --inputs ${WORK}/inputs --dump ${WORK}/d2
                RESULT_VARIABLE rc2 OUTPUT_VARIABLE o2 ERROR_VARIABLE e2)
message("${o2}${e2}")
if(NOT rc2 EQUAL 0)
  message(FATAL_ERROR "replayed gradcheck exited with ${rc2}")
endif()
file(GLOB outs RELATIVE ${WORK}/d1 ${WORK}/d1/*.npy)
list(LENGTH outs n)
if(n LESS 5)
  message(FATAL_ERROR "only ${n} dumped files: ${outs}")
endif()
foreach(f ${outs})
  execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${WORK}/d1/${f} ${WORK}/d2/${f}
                  RESULT_VARIABLE same)
  if(NOT same EQUAL 0)
    message(FATAL_ERROR "${f} differs between the synthetic run and its replay")
  endif()
endforeach()
message("replay: ${n} outputs identical: ${outs}")
