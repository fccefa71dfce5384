# SPDX-License-Identifier: Apache-2.0
# `cmake --install` of this build's "system" component into a fresh prefix, then what a user of
# it does: both binaries answer --version, the systemd unit names the installed daemon and
# config, an edited config survives a second install, and a C++ program built with
# find_package(trainstream) opens a session on the installed daemon through the installed
# library.
#   cmake -DBUILD_DIR=... -DWORK_DIR=... -DCONSUMER_SOURCE=... -DGENERATOR=...
#         -P check_install.cmake
foreach(v BUILD_DIR WORK_DIR CONSUMER_SOURCE GENERATOR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "check_install.cmake: -D${v}= is required")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()

set(prefix ${WORK_DIR}/prefix)
file(REMOVE_RECURSE ${WORK_DIR})
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix} --component system)

include(GNUInstallDirs)
foreach(f bin/trainstreamd bin/tsctl include/trainstream/client.h include/trainstream/version.h
          lib/systemd/system/trainstreamd.service lib/systemd/system/trainstream-metrics.service
          lib/systemd/system/trainstreamd.socket
          lib/sysusers.d/trainstream.conf
          lib/tmpfiles.d/trainstream.conf etc/trainstream/trainstreamd.conf
          ${CMAKE_INSTALL_LIBDIR}/cmake/trainstream/trainstreamConfig.cmake
          ${CMAKE_INSTALL_LIBDIR}/cmake/trainstream/trainstreamConfigVersion.cmake
          ${CMAKE_INSTALL_LIBDIR}/cmake/trainstream/trainstreamTargets.cmake)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "cmake --install did not install ${f}")
  endif()
endforeach()
file(GLOB libraries ${prefix}/${CMAKE_INSTALL_LIBDIR}/libtrainstream_client.so*)
if(NOT libraries)
  message(FATAL_ERROR "cmake --install did not install libtrainstream_client.so")
endif()
# The library exports its API and nothing of the gRPC, protobuf and Abseil code inside it.
find_program(NM nm)
if(NM)
  file(GLOB library ${prefix}/${CMAKE_INSTALL_LIBDIR}/libtrainstream_client.so)
  run(${NM} -DC --defined-only ${library})
  string(REGEX REPLACE "[^\n]*trainstream::client::[^\n]*\n" "" foreign "${out}")
  if(NOT foreign STREQUAL "")
    message(FATAL_ERROR "libtrainstream_client.so exports more than its API:\n${foreign}")
  endif()
endif()
# Nothing of the Python package: that is the wheel's.
file(GLOB_RECURSE python_files ${prefix}/*.py ${prefix}/*_trainstream*)
if(python_files)
  message(FATAL_ERROR "the system component installed Python files: ${python_files}")
endif()

foreach(binary trainstreamd tsctl)
  run(${prefix}/bin/${binary} --version)
  if(NOT out MATCHES "0\\.1\\.0")
    message(FATAL_ERROR "${binary} --version printed no version: ${out}")
  endif()
endforeach()

file(STRINGS ${prefix}/lib/systemd/system/trainstreamd.service exec REGEX "^ExecStart=")
set(want "ExecStart=${prefix}/bin/trainstreamd")
string(APPEND want " --config=${prefix}/etc/trainstream/trainstreamd.conf")
if(NOT exec STREQUAL want)
  message(FATAL_ERROR "the installed unit says\n  ${exec}\nnot\n  ${want}")
endif()
file(STRINGS ${prefix}/lib/systemd/system/trainstream-metrics.service exec REGEX "^ExecStart=")
if(NOT exec MATCHES "^ExecStart=${prefix}/bin/tsctl ")
  message(FATAL_ERROR "the installed metrics unit says\n  ${exec}\nnot the prefix's tsctl")
endif()

# An operator's edited config survives a second install.
file(APPEND ${prefix}/etc/trainstream/trainstreamd.conf "# edited\n")
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix} --component system)
file(READ ${prefix}/etc/trainstream/trainstreamd.conf config)
if(NOT config MATCHES "# edited\n$")
  message(FATAL_ERROR "a second install replaced the edited config")
endif()

run(${CMAKE_COMMAND} -S ${CONSUMER_SOURCE} -B ${WORK_DIR}/consumer -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/consumer)
run(${WORK_DIR}/consumer/consumer ${prefix}/bin/trainstreamd)
message(STATUS "${out}")
